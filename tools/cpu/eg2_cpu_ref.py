"""PyTorch reference timings of EmbeddingGemma 2 on the CPU, for issue 18's table: transformers 5.25
(eager attention, sdpa), the model loaded once from a folder (make_eg2_full.py), f32 or bf16 via
autocast, a fixed thread count. Workloads as `tessera bench embed/image` runs them: a 17-token
query, a 2,208-token document, N documents of L random ids as one batch, one 641x479 image
(42x57 = 2,394 patches, 266 soft tokens). One JSON line per measurement, with the first run, the
median, best and worst of the timed runs and the 1-minute load average.

Usage: eg2_cpu_ref.py MODEL_DIR --threads 2 [--bf16] [--workloads query,document,batch,image]
                      [--batch 64x64] [--iters N]"""
import argparse, json, os, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--bf16", action="store_true")
ap.add_argument("--workloads", default="query,document,batch,image")
ap.add_argument("--batch", default="64x64")
ap.add_argument("--iters", type=int, default=None)
a = ap.parse_args()
torch.set_num_threads(a.threads)
from transformers.models.embedding_gemma2 import EmbeddingGemma2Model

t0 = time.perf_counter()
# SDPA for the towers timed; the audio tower (not timed) has no SDPA path in transformers 5.25, and
# a plain "sdpa" for the whole model fails on it.
attn = {"text_config": "sdpa", "vision_config": "sdpa", "audio_config": "eager"}
model = EmbeddingGemma2Model.from_pretrained(a.model, dtype=torch.float32, attn_implementation=attn).eval()
load_s = time.perf_counter() - t0
cfg = model.config
lm = model.language_model
V = cfg.text_config.vocab_size
precision = "bf16-autocast" if a.bf16 else "f32"


def load1():
    return os.getloadavg()[0]


def bench(fn, n):
    t = time.perf_counter(); fn(); first = time.perf_counter() - t
    for _ in range(max(n // 10, 1) - 1):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort()
    return dict(median_ms=ts[len(ts) // 2] * 1e3, best_ms=ts[0] * 1e3, worst_ms=ts[-1] * 1e3, first_ms=first * 1e3,
                iters=n, load1=load1())


def emit(name, **kw):
    print(json.dumps(dict(name=name, engine="torch " + torch.__version__, precision=precision, threads=a.threads, **kw)),
          flush=True)


def ids(n, b=1):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(3, min(V, 250000), (b, n), generator=g); t[:, 0] = 2; t[:, -1] = 1
    return t


@torch.inference_mode()
def emb(t):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        h = lm(input_ids=t).last_hidden_state
    return torch.nn.functional.normalize(h.float().mean(1), dim=-1)


emit("load", seconds=load_s)
wanted = a.workloads.split(",")
if "query" in wanted:
    q = ids(17)
    emit("eg2_W1_query", tokens=17, **bench(lambda: emb(q), a.iters or 30))
if "document" in wanted:
    d = ids(2208)
    emit("eg2_W2_doc", tokens=2208, **bench(lambda: emb(d), a.iters or 5))
if "batch" in wanted:
    n, L = map(int, a.batch.split("x"))
    b = ids(L, n)
    emit("eg2_batch", docs=n, tokens_per_doc=L, **bench(lambda: emb(b), a.iters or 3))
if "image" in wanted:
    ps = cfg.vision_config.patch_size
    ph, pw = 42, 57
    npatch = ph * pw
    pix = torch.rand(1, npatch, 3 * ps * ps)
    pos = torch.stack([torch.arange(npatch) % pw, torch.arange(npatch) // pw], -1)[None]
    nsoft = (ph // 3) * (pw // 3)
    t = torch.tensor([[2, cfg.boi_token_id] + [cfg.image_token_id] * nsoft + [cfg.eoi_token_id, 1]])

    @torch.inference_mode()
    def img():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            h = model(input_ids=t, pixel_values=pix, image_position_ids=pos).last_hidden_state
        return torch.nn.functional.normalize(h.float().mean(1), dim=-1)

    emit("eg2_image_single", patches=npatch, soft_tokens=nsoft, **bench(img, a.iters or 3))
