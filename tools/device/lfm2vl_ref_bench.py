#!/usr/bin/env python3
"""The transformers reference's speed on LFM2-VL, on the work Tessera's speed is measured on.

Loads MODEL_DIR (e.g. the random full-size model of make_lfm2vl_full.py) with
`Lfm2VlForConditionalGeneration.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, attn_implementation="sdpa",
use_kernels=False)` (transformers 5.25 refuses to load without the `kernels` package otherwise; the hub kernels
could not be fetched on the GPU machine anyway) and prints one JSON line
per measurement (stdout; progress and warnings go to stderr):

  image_encode  `model.get_image_features` on one image's processor output (all its tiles in one batch, padded
                to max_num_patches as the processor does). Default images (synthetic, seeded): 512x512 (one
                tile of 256 tokens with the published settings) and 1024x768 (tiled; a thumbnail only if the
                processor's use_thumbnail says so: the published 450M settings say no). --image PATH (repeatable)
                replaces them. Median ms over --iters.
  prefill       one forward over a text-only prompt of N tokens (random ids in [8, 395], batch 1) with
                use_cache=True, per N in --prompt-tokens. Median ms and tokens/s.
  decode        `model.generate(input_ids, max_new_tokens=M, min_new_tokens=M, do_sample=False)` on a 64-token
                prompt (random ids in [8, 395], the same prompt in every row), per batch size in --batch; timed
                with M and with 1 new token, the difference is the M − 1 decode steps without the prefill:
                tokens/s per sequence = (M − 1) / (t_M − t_1), total = batch × that. Medians over --iters.
Every run is preceded by --warmup untimed runs; on CUDA `torch.cuda.synchronize()` brackets each timing.

--compile adds, after the eager lines, prefill and decode lines with "compile": WAY, trying in turn, each in a
child process (a CUDA-graph crash took the whole process down with torch 2.11 on the H200), until one completes:
  lm-reduce-overhead-static  the language model's forward (model.model.language_model.forward) wrapped in
                             torch.compile(mode="reduce-overhead") (CUDA graphs), decoding with a static cache
                             (`cache_implementation="static"`, fixed decode shapes); transformers' own
                             auto-compile switched off so that only this wrapper compiles
  generate-autocompile       transformers' own way: generate(cache_implementation="static") compiles the whole
                             model's call for the decode steps (CompileConfig defaults, reduce-overhead); the
                             prefill stays eager there, so no prefill line; "compiled_call_used" says whether
                             transformers did compile (it does so on CUDA only)
  lm-default-dynamic         the language model's forward under torch.compile(mode="default", dynamic=True), the
                             dynamic cache
A way that fails leaves a line {"kind": "compile", "compile": WAY, "failed": "rc=..: last stderr lines"} (and any
lines it printed before failing); if none completes, a last line {"kind": "compile", "skipped": ...}. Where
Inductor reports "skipping cudagraphs" (e.g. mutated inputs: the cache's counters), the lines carry
"cudagraphs_skipped": [reasons]: those timings are compiled kernels without CUDA graphs. Compilation happens in
the warmup runs; its time is in "compile_warmup_s". Dynamo's recompile limit is raised to 256 (each prompt length,
batch size and static cache length is a graph; at the default 8 it would silently fall back to eager).

Fields of every line: kind, model (MODEL_DIR), device, gpu (name or null), torch, transformers, dtype
("bfloat16"), attn ("sdpa"), compile (false or the mode), causal_conv1d (whether the `causal_conv1d` kernel
package is importable; with use_kernels=False transformers runs LFM2's short convolution in plain PyTorch either
way), iters,
warmup, and per kind:
  image_encode  image (WxH or path), tiles, spatial_shapes, patches, image_tokens, thumbnail, ms (median), ms_all
  prefill       prompt_tokens, batch, ms, tokens_per_s, ms_all
  decode        prompt_tokens, batch, new_tokens, ms_generate_M, ms_generate_1, decode_ms (t_M − t_1),
                tokens_per_s_per_seq, tokens_per_s_total, ms_per_step

Usage (repository root; CUDA torch 2.15 / transformers 5.25 / torchvision 0.29.2):
  lfm2vl_ref_bench.py MODEL_DIR --device cuda [--image PATH ...] [--prompt-tokens N[,N...]] [--new-tokens 128]
                      [--batch 1,8] [--iters 5] [--warmup 2] [--compile [--compile-timeout 480]]
                      [--skip image_encode,prefill,decode]
CPU check with the miniature (a few seconds):
  lfm2vl_ref_bench.py crates/models/assets/lfm2vl-mini --device cpu --prompt-tokens 64 --new-tokens 8 \\
                      --batch 1,2 --iters 2 --warmup 1
"""
import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoProcessor, Lfm2VlForConditionalGeneration

DECODE_PROMPT = 64
IMAGE_TOKEN_ID = 396


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters, warmup):
    """Median and all wall times (ms) of fn(), after `warmup` untimed calls; returns (median, all, warmup_s)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync(device)
    warm = time.perf_counter() - t0
    ts = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), ts, warm


def synthetic_image(w, h, seed):
    """Smooth gradients plus noise, uint8 RGB (content is irrelevant to the speed; sizes are what count)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(2 * np.pi * (x / w * (c + 1) + y / h * (3 - c))) for c in range(3)], -1)
    img += rng.uniform(-10, 10, img.shape)
    return Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8), "RGB")


def emit(base, **kw):
    print(json.dumps(dict(base, **kw)), flush=True)


def bench_images(model, proc, images, device, args, base):
    ip = proc.image_processor
    for label, img in images:
        enc = ip(images=[img], return_tensors="pt", return_row_col_info=True)
        pv = enc["pixel_values"].to(device)
        shapes = enc["spatial_shapes"].to(device)
        mask = enc["pixel_attention_mask"].to(device)
        rows, cols = int(enc["image_rows"][0]), int(enc["image_cols"][0])
        n = pv.shape[0]
        thumb = rows * cols > 1 and n == rows * cols + 1

        def run():
            with torch.inference_mode():
                return model.get_image_features(pixel_values=pv, spatial_shapes=shapes, pixel_attention_mask=mask)

        tokens = sum(f.shape[0] for f in run().pooler_output)
        med, ts, _ = timed(run, device, args.iters, args.warmup)
        emit(base, kind="image_encode", image=label, tiles=n, grid=[rows, cols], thumbnail=thumb,
             spatial_shapes=enc["spatial_shapes"].tolist(), patches=int(enc["pixel_attention_mask"].sum()),
             padded_patches=int(pv.shape[0] * pv.shape[1]), image_tokens=tokens, ms=med, ms_all=ts)


def random_ids(n, batch, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 396, (1, n), generator=g)
    return ids.repeat(batch, 1).to(device)


def bench_prefill(model, device, args, base, compiled=None):
    warm_s = None
    for n in args.prompt_tokens:
        ids = random_ids(n, 1, device, seed=n)

        def run():
            with torch.inference_mode():
                return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).logits

        med, ts, warm = timed(run, device, args.iters, args.warmup)
        warm_s = warm
        emit(base, kind="prefill", prompt_tokens=n, batch=1, ms=med, tokens_per_s=n / med * 1e3, ms_all=ts,
             **({"compile_warmup_s": warm} if compiled else {}))
    return warm_s


def bench_decode(model, device, args, base, gen_kwargs=None, compiled=None):
    gen_kwargs = gen_kwargs or {}
    m = args.new_tokens
    for b in args.batch:
        ids = random_ids(DECODE_PROMPT, b, device, seed=1000 + b)
        am = torch.ones_like(ids)

        def gen(k):
            def run():
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=k, min_new_tokens=k,
                                         do_sample=False, pad_token_id=0, **gen_kwargs)
                assert out.shape == (b, DECODE_PROMPT + k), out.shape
                return out
            return run

        t_m, ts_m, warm_m = timed(gen(m), device, args.iters, args.warmup)
        t_1, ts_1, warm_1 = timed(gen(1), device, args.iters, args.warmup)
        dec = t_m - t_1
        per_seq = (m - 1) / dec * 1e3 if dec > 0 else float("nan")
        emit(base, kind="decode", prompt_tokens=DECODE_PROMPT, batch=b, new_tokens=m, ms_generate_M=t_m,
             ms_generate_1=t_1, decode_ms=dec, ms_per_step=dec / (m - 1) if m > 1 else None,
             tokens_per_s_per_seq=per_seq, tokens_per_s_total=b * per_seq, ms_generate_M_all=ts_m,
             ms_generate_1_all=ts_1, **({"compile_warmup_s": warm_m + warm_1} if compiled else {}))


# The ways --compile tries, in order, each in a child process (a crash in CUDA graphs can take the process down: it
# happened with torch 2.11 on the H200); the first that completes ends the list.
#   lm-reduce-overhead-static  torch.compile(language_model.forward, mode="reduce-overhead"), static cache
#   generate-autocompile       transformers' own: generate(cache_implementation="static") compiles the whole
#                              model's call for the decode steps (CompileConfig defaults: reduce-overhead); its
#                              prefill stays eager, so this way has no prefill line
#   lm-default-dynamic         torch.compile(language_model.forward, mode="default", dynamic=True), dynamic cache
COMPILE_WAYS = ("lm-reduce-overhead-static", "generate-autocompile", "lm-default-dynamic")


def compiled_run(model, device, args, base, way):
    """One way of compiling (COMPILE_WAYS): prefill and decode lines with "compile": way."""
    lm = model.model.language_model
    # Prompt lengths, batch sizes and static cache lengths each make a graph: keep dynamo from giving up (and
    # silently running eager) at its default limit of 8.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    b = dict(base, compile=way)
    if way == "generate-autocompile":
        model.generation_config.disable_compile = False
        ids = random_ids(DECODE_PROMPT, 1, device, seed=0)
        with torch.inference_mode():  # does transformers compile here? (it does on CUDA with a static cache only)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                           pad_token_id=0, cache_implementation="static")
        b["compiled_call_used"] = hasattr(model, "_compiled_call")
        bench_decode(model, device, args, b, gen_kwargs=dict(cache_implementation="static"), compiled=way)
        return
    model.generation_config.disable_compile = True  # only our wrapper compiles
    if way == "lm-reduce-overhead-static":
        lm.forward = torch.compile(lm.forward, mode="reduce-overhead")
        gen_kwargs = dict(cache_implementation="static")
    else:
        lm.forward = torch.compile(lm.forward, mode="default", dynamic=True)
        gen_kwargs = {}
    bench_prefill(model, device, args, b, compiled=way)
    bench_decode(model, device, args, b, gen_kwargs=gen_kwargs, compiled=way)


def compiled_runs(args, base):
    """Each way of COMPILE_WAYS in a child process until one completes; its lines (and a failed one's) printed."""
    for way in COMPILE_WAYS:
        cmd = [sys.executable, os.path.abspath(__file__), args.model_dir, "--device", args.device,
               "--prompt-tokens", ",".join(map(str, args.prompt_tokens)), "--new-tokens", str(args.new_tokens),
               "--batch", ",".join(map(str, args.batch)), "--iters", str(args.iters), "--warmup", str(args.warmup),
               "--compiled-only", way]
        log(f"compile: {way} (child process, at most {args.compile_timeout} s) ...")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.compile_timeout)
            rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        # Inductor says so when it could not use CUDA graphs (the timings are then compiled kernels without graphs).
        skipped = sorted({ln.split("[__cudagraphs]", 1)[1].strip().split(". Found from")[0]
                          for ln in err.splitlines() if "[__cudagraphs] skipping cudagraphs" in ln})
        for ln in out.splitlines():
            if ln.startswith("{"):
                d = json.loads(ln)
                if skipped:
                    d["cudagraphs_skipped"] = skipped
                print(json.dumps(d), flush=True)
        if rc == 0:
            log(f"compile: {way} done in {time.perf_counter() - t0:.0f} s")
            return
        tail = [ln for ln in err.splitlines()
                if ln.strip() and not any(x in ln for x in ("Loading weights", "is falling back to its reference",
                                                            "[__cudagraphs]"))][-3:]
        if isinstance(rc, int) and rc < 0:
            rc = f"{rc} ({signal.Signals(-rc).name})"
        reason = f"rc={rc}: " + " | ".join(t.strip()[:300] for t in tail)
        log(f"compile: {way} failed ({reason})")
        emit(base, kind="compile", compile=way, failed=reason, **({"cudagraphs_skipped": skipped} if skipped else {}))
    emit(base, kind="compile", skipped="no way of compiling completed (see the failed lines)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--image", action="append", default=None, help="an image file (repeatable); replaces the "
                    "synthetic 512x512 and 1024x768")
    ap.add_argument("--prompt-tokens", default="512", help="prefill prompt length(s), comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-timeout", type=int, default=480, help="seconds for each way of compiling")
    ap.add_argument("--compiled-only", choices=COMPILE_WAYS, help=argparse.SUPPRESS)  # the child of --compile
    ap.add_argument("--skip", default="", help="kinds to leave out, comma-separated (image_encode,prefill,decode)")
    args = ap.parse_args()
    args.prompt_tokens = [int(x) for x in args.prompt_tokens.split(",") if x]
    args.batch = [int(x) for x in args.batch.split(",") if x]
    assert args.new_tokens >= 2, "--new-tokens must be at least 2 (the decode time is t(M) − t(1))"
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))

    t0 = time.perf_counter()
    model = Lfm2VlForConditionalGeneration.from_pretrained(args.model_dir, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa", use_kernels=False
                                                           ).to(device).eval()
    proc = AutoProcessor.from_pretrained(args.model_dir)
    log(f"loaded {args.model_dir} on {device} in {time.perf_counter() - t0:.1f} s")
    base = dict(model=args.model_dir, device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                torch=torch.__version__, transformers=transformers.__version__, dtype="bfloat16", attn="sdpa",
                compile=False, causal_conv1d=importlib.util.find_spec("causal_conv1d") is not None,
                iters=args.iters, warmup=args.warmup)

    if args.compiled_only:
        compiled_run(model, device, args, base, args.compiled_only)
        return
    if "image_encode" not in skip:
        if args.image:
            images = [(p, Image.open(p).convert("RGB")) for p in args.image]
        else:
            images = [("512x512", synthetic_image(512, 512, 1)), ("1024x768", synthetic_image(1024, 768, 2))]
        bench_images(model, proc, images, device, args, base)
    if "prefill" not in skip:
        bench_prefill(model, device, args, base)
    if "decode" not in skip:
        bench_decode(model, device, args, base)
    if args.compile:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        compiled_runs(args, base)
    log(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
