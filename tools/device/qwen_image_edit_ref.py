"""diffusers 0.42.1 reference timings for Qwen-Image-2.1 editing (issue 29): `QwenImage21Pipeline`
with one condition image, bf16, CUDA, sdpa, eager, beside `tessera bench generate --image`.

    python3 qwen_image_edit_ref.py --model DIR --image COND.png [--steps 40] [--size 1024x1024]
        [--guidance G --negative-prompt TEXT] [--iters 2] [--modes cache,nocache]
    python3 qwen_image_edit_ref.py --tiny        # CPU, float32, the bundled miniature, seconds

DIR is a full-size random-weight folder from `make_qwen_image_full.py DIR MINI --vision-depth 27`
(the published tower's 27 blocks). One line per measurement starting with `RESULT ` (JSON), as
../../../shared/tools/refbench_qi21_lfm2vl.py prints them; CUDA events time the GPU's stream, a
warm-up comes first, the device is synchronised before every clock read, figures are medians.

The pipeline's two modes (diffusers 0.42.1 `pipeline_qwenimage21.py`, `__call__`): the prefix
cache is the `use_kv_cache` argument, on by default and effective when the transformer's config
has `causal_condition` (the published one does). With it on (`cache`) step 0 runs the whole
sequence — text rows, the condition image's latent tokens and the target — with
`kv_cache_mode="extract"`, keeping the text and condition keys and values in a
`QwenImage21KVCache` per prompt branch; steps 1… run the target rows alone against them
(`kv_cache_mode="cached"`). With `use_kv_cache=False` (`nocache`) every step recomputes the
whole sequence, prefix included. True CFG (`true_cfg_scale` above 1 with a negative prompt,
Tessera's `--guidance` with `--negative-prompt`) runs the negative branch with its own cache.

Measured per mode, per run: the condition image's host resize (`preprocess`), `encode_prompt`
(processor, vision tower and text encoder; the vision tower alone by a forward hook), the VAE
encoder (`prepare_latents`), step 0, the median later step, the VAE decode with the PIL image, and
the whole call. Also the VAE encoder alone on the condition image (`vae_encode_*`), and the prefix
rows (text rows + condition latent tokens) the DiT sees.
"""
import argparse, json, os, statistics, sys, time

# peft (on the GPU machine) is irrelevant here and imports model classes a trimmed transformers
# wheel leaves out; a None entry makes diffusers and transformers treat it as absent.
sys.modules.setdefault("peft", None)

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MINI = os.path.join(ROOT, "crates", "models", "assets", "qwen-image-mini")

ap = argparse.ArgumentParser()
ap.add_argument("--model", help="a Qwen-Image-2.1 folder (diffusers layout)")
ap.add_argument("--image", help="the condition image (RGBA PNG for the VAE's 4 channels)")
ap.add_argument("--size", default="1024x1024", help="output WIDTHxHEIGHT")
ap.add_argument("--output-resolution", type=int, default=1024, help="condition images resize to about its square")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--guidance", type=float, default=1.0, help="true_cfg_scale; true CFG above 1 with --negative-prompt")
ap.add_argument("--negative-prompt", default=None)
ap.add_argument("--prompt", default="a lighthouse on a cliff at dusk, dramatic sky, oil painting")
ap.add_argument("--iters", type=int, default=2, help="timed runs per mode (after one warm-up)")
ap.add_argument("--warmup-steps", type=int, default=2, help="steps of the warm-up run")
ap.add_argument("--modes", default="cache,nocache")
ap.add_argument("--budget", type=float, default=1e9, help="seconds; a mode that would start past it is skipped")
ap.add_argument("--tiny", action="store_true", help="the bundled miniature on the CPU in float32, to check the script")
a = ap.parse_args()
T0 = time.time()
DEV = "cpu" if a.tiny else "cuda"
DT = torch.float32 if a.tiny else torch.bfloat16
if a.tiny:
    a.model = a.model or MINI
    a.steps = min(a.steps, 3)
    a.size = "64x64" if a.size == "1024x1024" else a.size
    a.output_resolution = 64 if a.output_resolution == 1024 else a.output_resolution
if not a.model:
    ap.error("--model is required (or --tiny)")


def log(*x):
    print(f"[{time.time() - T0:6.1f}s]", *x, flush=True)


def emit(name, **kw):
    print("RESULT " + json.dumps({"name": name, **kw}), flush=True)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class Clock:
    """Marks on the device's stream (CUDA events) or the host clock (CPU), read as seconds after the first."""

    def __init__(self):
        self.marks = []

    def mark(self, what):
        if DEV == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((what, e))
        else:
            self.marks.append((what, time.perf_counter()))

    def times(self):
        sync()
        t0 = self.marks[0][1]
        if DEV == "cuda":
            return [(w, t0.elapsed_time(e) / 1e3) for w, e in self.marks]
        return [(w, t - t0) for w, t in self.marks]


def timeit(fn, warm=2, n=5):
    """Median/min milliseconds of fn() after `warm` warm-ups (CUDA events on the GPU)."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(n):
        c = Clock()
        c.mark("start")
        fn()
        c.mark("end")
        ts.append(c.times()[-1][1])
    return dict(median_ms=round(statistics.median(ts) * 1e3, 3), min_ms=round(min(ts) * 1e3, 3),
                max_ms=round(max(ts) * 1e3, 3), n=n, warm=warm)


def rgba_image(w, h):
    """A smooth RGBA test image with a transparent corner, as the driver makes one."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    px = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // max(w + h - 2, 1),
                   np.where((x < w // 4) & (y < h // 4), 0, 255)], -1).astype(np.uint8)
    return Image.fromarray(px, "RGBA")


def load_weights(module, folder):
    """Every safetensors shard of `folder` into `module`, straight to the device; every tensor must match."""
    import glob
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        sd.update(load_file(f, device=DEV))
    module.load_state_dict(sd, strict=True)
    return module.to(DT).eval().requires_grad_(False)


def load_pipeline(model):
    """The pipeline of `model`'s folder, each diffusers model built on the device (as the reference bench builds
    them: diffusers' `from_pretrained` initialises on the host when `accelerate` is absent, minutes for 7B) and its
    weights loaded there; the text encoder through transformers' `from_pretrained`."""
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    parts = {}
    for name, cls in (("transformer", QwenImage21Transformer2DModel), ("vae", AutoencoderKLQwenImage21)):
        folder = os.path.join(model, name)
        with torch.device(DEV):
            m = cls.from_config(cls.load_config(folder))
        parts[name] = load_weights(m, folder)
    # use_kernels=False: transformers 5.25 otherwise asks for the `kernels` hub package (0.19.x),
    # which the GPU machine's environment has in another version ("Kernels are not available").
    te = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(model, "text_encoder"), dtype=DT,
                                                         use_kernels=False)
    parts["text_encoder"] = te.to(DEV).eval().requires_grad_(False)
    parts["processor"] = Qwen3VLProcessor.from_pretrained(os.path.join(model, "processor"))
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(model, "scheduler"))
    return QwenImage21Pipeline(**parts)


@torch.no_grad()
def main():
    import diffusers
    import transformers
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
    from PIL import Image

    info = dict(torch=torch.__version__, diffusers=diffusers.__version__, transformers=transformers.__version__,
                device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", dtype=str(DT))
    emit("edit_env", **info)
    t = time.time()
    pipe = load_pipeline(a.model)
    pipe.set_progress_bar_config(disable=True)
    tcfg = pipe.transformer.config
    vcfg = pipe.text_encoder.config.vision_config
    emit("edit_load", seconds=round(time.time() - t, 1), model=a.model, causal_condition=tcfg.causal_condition,
         dit_layers=tcfg.num_layers, vision_depth=vcfg.depth, deepstack=list(vcfg.deepstack_visual_indexes))

    if a.image:
        cond = Image.open(a.image)
        cond.load()
    else:
        cond = rgba_image(*(2 * [a.output_resolution]))
    width, height = (int(v) for v in a.size.lower().split("x"))
    cw, ch, _ = calculate_dimensions(a.output_resolution ** 2, cond.size[0] / cond.size[1])
    guided = a.guidance > 1 and a.negative_prompt is not None
    branches = 2 if guided else 1

    # The vision tower's share of encode_prompt, by hooks on its module.
    visual = pipe.text_encoder.model.visual
    clock = [None]
    visual.register_forward_pre_hook(lambda m, args: clock[0] and clock[0].mark("vision_start"))
    visual.register_forward_hook(lambda m, args, out: clock[0] and clock[0].mark("vision_end"))

    # The prefix the DiT sees: the prompt's rows with the pad run replaced by the latent block.
    rgba = cond.convert("RGBA")
    resized = pipe.image_processor.resize(rgba, width=cw, height=ch)
    pe, _, ipm = pipe.encode_prompt(prompt=a.prompt, image=[resized], device=torch.device(DEV))
    pads = int(ipm.sum())
    latent_tokens = (ch // 16) * (cw // 16)
    emit("edit_prefix", prompt_rows=pe.shape[1], image_pad_tokens=pads, condition=f"{cw}x{ch}",
         condition_latent_tokens=latent_tokens, prefix_rows=pe.shape[1] - pads + latent_tokens,
         target_rows=(height // 16) * (width // 16))

    # The VAE encoder alone on the condition image, as prepare_latents calls it.
    x = pipe.image_processor.preprocess(rgba, width=cw, height=ch).unsqueeze(2).to(DEV, DT)
    r = timeit(lambda: pipe._encode_vae_image(x, None), warm=2, n=3 if a.tiny else 10)
    emit(f"edit_vae_encode_{cw}x{ch}", input=list(x.shape), **r)
    log("vae encode", r)

    # Hooks on the pipeline's stages: encode_prompt (once per branch) and prepare_latents (the VAE encoder).
    real_encode, real_prepare = pipe.encode_prompt, pipe.prepare_latents

    def encode_prompt(*args, **kw):
        clock[0] and clock[0].mark("encode_prompt_start")
        out = real_encode(*args, **kw)
        clock[0] and clock[0].mark("encode_prompt_end")
        return out

    def prepare_latents(*args, **kw):
        clock[0] and clock[0].mark("prepare_latents_start")
        out = real_prepare(*args, **kw)
        clock[0] and clock[0].mark("prepare_latents_end")
        return out

    pipe.encode_prompt, pipe.prepare_latents = encode_prompt, prepare_latents

    def call(steps, use_cache, c=None):
        clock[0] = c
        if c:
            c.mark("start")
        kw = dict(prompt=a.prompt, image=cond, negative_prompt=a.negative_prompt, true_cfg_scale=a.guidance,
                  height=height, width=width, num_inference_steps=steps, output_resolution=a.output_resolution,
                  generator=torch.Generator(DEV).manual_seed(0), use_kv_cache=use_cache, output_type="pil")
        if c:
            kw["callback_on_step_end"] = lambda p, i, t, k: (c.mark("step"), {})[1]
        img = pipe(**kw).images[0]
        if c:
            c.mark("end")
        clock[0] = None
        return img

    def span(marks, a_, b_):
        """Seconds between the first mark named a_ and the next one named b_, summed over repeats."""
        total, start = 0.0, None
        for w, t in marks:
            if w == a_ and start is None:
                start = t
            elif w == b_ and start is not None:
                total += t - start
                start = None
        return total

    per_mode = {}
    for mode in a.modes.split(","):
        use_cache = mode == "cache"
        if time.time() - T0 > a.budget:
            log(f"skipping {mode}: budget")
            emit(f"edit_{mode}_skipped", reason="budget", budget_s=a.budget)
            continue
        t = time.time()
        call(a.warmup_steps, use_cache)
        sync()
        log(f"{mode} warm-up ({a.warmup_steps} steps)", round(time.time() - t, 1))
        runs = []
        for _ in range(max(a.iters, 1)):
            c = Clock()
            sync()
            w0 = time.perf_counter()
            img = call(a.steps, use_cache, c)
            sync()
            wall = time.perf_counter() - w0
            m = c.times()
            steps = [t for w, t in m if w == "step"]
            first_prompt = next(t for w, t in m if w == "encode_prompt_start")
            prep_end = next(t for w, t in m if w == "prepare_latents_end")
            later = [steps[i] - steps[i - 1] for i in range(1, len(steps))]
            runs.append(dict(
                wall_s=wall, e2e_s=m[-1][1], preprocess_ms=first_prompt * 1e3,
                encode_prompt_ms=span(m, "encode_prompt_start", "encode_prompt_end") * 1e3,
                vision_ms=span(m, "vision_start", "vision_end") * 1e3,
                vae_encode_ms=span(m, "prepare_latents_start", "prepare_latents_end") * 1e3,
                before_loop_ms=prep_end * 1e3, step0_ms=(steps[0] - prep_end) * 1e3,
                later_step_ms=statistics.median(later) * 1e3 if later else None,
                decode_ms=(m[-1][1] - steps[-1]) * 1e3))
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0] if runs[0][k] is not None}
        per_mode[mode] = med
        emit(f"edit_e2e_{width}x{height}_{a.steps}steps_{mode}", use_kv_cache=use_cache, guidance=a.guidance,
             branches=branches, image=f"{img.size[0]}x{img.size[1]} {img.mode}", iters=len(runs), **med,
             how="median of runs; times on the device's stream (CUDA events); wall_s on the host; step0 = "
                 "prefill + first step with the cache, a whole-sequence step without; decode = VAE + PIL")
        log(mode, med)
    if DEV == "cuda":
        emit("edit_peak_mem", gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
    if "cache" in per_mode and "nocache" in per_mode:
        c, n = per_mode["cache"], per_mode["nocache"]
        emit("edit_cache_speedup", step_ratio=round(n["later_step_ms"] / c["later_step_ms"], 3)
             if c.get("later_step_ms") and n.get("later_step_ms") else None, e2e_ratio=round(n["e2e_s"] / c["e2e_s"], 3))


if __name__ == "__main__":
    log(f"model={a.model} tiny={a.tiny} size={a.size} steps={a.steps} guidance={a.guidance} torch={torch.__version__}")
    try:
        main()
    except Exception as e:
        import traceback
        traceback.print_exc()
        emit("FAILED_edit_ref", error=f"{type(e).__name__}: {str(e)[:500]}")
        sys.exit(1)
    log("done")
