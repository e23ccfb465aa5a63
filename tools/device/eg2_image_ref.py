"""Reference (PyTorch) image-embedding throughput for EmbeddingGemma 2, to set beside
`tessera bench image`: the same 256 images (random pixels; sizes cycling through the same list as
`MIXED_SIZES` in crates/cli/src/bench.rs), preprocessed by transformers' Gemma4ImageProcessor
(budget 280) and embedded by EmbeddingGemma2Model (bf16, sdpa) in padded batches, as a
transformers user would: `<bos> <|image> <|image|>×N <image|> <eos>` per image, mean over the real
tokens, L2. Time includes preprocessing.
Then one 641×479 image's latency as `refbench.py` measures it (median of 50 after warm-up; budget
280 → 42×57 patches already on the GPU as pixel values, so no decode or resize is timed), for the
runs that re-measure only the image rows. Usage: eg2_image_ref.py MODEL_DIR [--tiny-cpu]"""
import json, sys, time

import numpy as np
import torch
from safetensors.torch import load_file
from transformers.models.embedding_gemma2 import EmbeddingGemma2Config, EmbeddingGemma2Model
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor

SIZES = [(641, 479), (1024, 768), (512, 512), (800, 600), (1280, 720), (300, 400), (1920, 1080), (96, 64)]
mdir = sys.argv[1]
cpu = "--tiny-cpu" in sys.argv
dev, dt = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
n_images = 16 if cpu else 256
cfg = EmbeddingGemma2Config.from_json_file(f"{mdir}/config.json")
cfg._attn_implementation = "sdpa"
with torch.device(dev):
    m = EmbeddingGemma2Model(cfg).to(dt).eval()
m.load_state_dict({k: v.to(dt) for k, v in load_file(f"{mdir}/model.safetensors").items()}, strict=False)
vc = cfg.vision_config
proc = Gemma4ImageProcessor(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
                            max_soft_tokens=70 if cpu else 280, do_convert_rgb=True, do_resize=True,
                            do_rescale=True, rescale_factor=1 / 255, do_normalize=False, resample=3)
rng = np.random.default_rng(0)
images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for (w, h) in (SIZES[i % len(SIZES)] for i in range(n_images))]
bos, eos = cfg.text_config.bos_token_id, cfg.text_config.eos_token_id


@torch.no_grad()
def embed(batch):
    p = proc(images=batch, return_tensors="pt")
    n = p["num_soft_tokens_per_image"].tolist()
    length = max(n) + 4
    ids = torch.full((len(batch), length), cfg.text_config.pad_token_id or 0)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, k in enumerate(n):
        ids[i, :k + 4] = torch.tensor([bos, cfg.boi_token_id] + [cfg.image_token_id] * k + [cfg.eoi_token_id, eos])
        mask[i, :k + 4] = 1
    out = m(input_ids=ids.to(dev), attention_mask=mask.to(dev), pixel_values=p["pixel_values"].to(dev, dt),
            image_position_ids=p["image_position_ids"].to(dev)).last_hidden_state.float()
    mk = mask.to(dev).unsqueeze(-1).float()
    e = (out * mk).sum(1) / mk.sum(1)
    return torch.nn.functional.normalize(e, dim=-1)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


best = 0
for bs in ([4] if cpu else [8, 16, 32]):
    def run():
        for i in range(0, len(images), bs):
            embed(images[i:i + bs])
        sync()
    run()  # warm-up
    times = []
    for _ in range(1 if cpu else 2):
        t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
    rate = len(images) / min(times)
    best = max(best, rate)
    print(json.dumps({"name": "ref_eg2_images_mixed", "batch": bs, "images": len(images), "images_per_s": rate}), flush=True)
print(json.dumps({"name": "ref_eg2_images_mixed_best", "images_per_s": best}))

# One image, as refbench.py times it: random pixel values already on the device, forward, mean, L2.
ps = vc.patch_size
ph, pw = (6, 9) if cpu else (42, 57)
n = ph * pw
pix = torch.rand(1, n, 3 * ps * ps, device=dev, dtype=dt)
pos = torch.stack([torch.arange(n, device=dev) % pw, torch.arange(n, device=dev) // pw], -1)[None]
nsoft = (ph // 3) * (pw // 3)
ids = torch.tensor([[bos, cfg.boi_token_id] + [cfg.image_token_id] * nsoft + [cfg.eoi_token_id, eos]], device=dev)
times = []
with torch.no_grad():
    for i in range(5 + (5 if cpu else 50)):
        sync()
        t = time.perf_counter()
        h = m(input_ids=ids, pixel_values=pix, image_position_ids=pos).last_hidden_state
        torch.nn.functional.normalize(h.float().mean(1), dim=-1)
        sync()
        if i >= 5:
            times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"name": "ref_eg2_image_single", "patches": n, "soft_tokens": nsoft,
                  "median_ms": times[len(times) // 2] * 1e3, "best_ms": times[0] * 1e3}))
