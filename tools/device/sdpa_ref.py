"""PyTorch's scaled_dot_product_attention on the shapes `tessera bench attention` times, in the
same call (GPU machine): bf16, non-causal, q/k/v as strided column slices of one fused q|k|v
buffer as the models keep them. Prints one JSON line per (shape, SDPA backend): median ms over
20 runs after a warm-up, and TFLOP/s (4·rows²·heads·head_dim)."""
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # name, rows, heads, head_dim
    ("dit 4224x30x128", 4224, 30, 128),
    ("4096x16x64", 4096, 16, 64),
    ("image 2394 patches", 2394, 12, 64),
]
BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def main():
    torch.manual_seed(0)
    for name, rows, heads, d in SHAPES:
        width = 3 * heads * d
        qkv = (torch.randn(rows, width, device="cuda") * 0.25).to(torch.bfloat16)
        q, k, v = (qkv[:, i * heads * d:(i + 1) * heads * d].view(rows, heads, d).transpose(0, 1)[None]
                   for i in range(3))
        flops = 4.0 * rows * rows * heads * d
        for backend in BACKENDS:
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v)
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(20):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        F.scaled_dot_product_attention(q, k, v)
                        b.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(b))
            except RuntimeError as e:
                print(json.dumps({"shape": name, "backend": backend.name, "error": str(e).splitlines()[0]}))
                continue
            ms = statistics.median(times)
            print(json.dumps({"shape": name, "backend": backend.name, "median_ms": ms,
                              "min_ms": min(times), "max_ms": max(times), "tflops": flops / (ms / 1e3) / 1e12}))


if __name__ == "__main__":
    main()
