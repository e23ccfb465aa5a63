#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): the attention kernels alone — their
# parity against the CPU (cuda_ops, both kernels, whole and split) and `tessera bench attention`
# on the EmbeddingGemma 2 shapes, as a short table. A minute of device time instead of the full
# eg2_cuda.sh run, for iterating on a kernel. Build first with tools/device/stage.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TESSERA_CACHE_DIR=/tmp/tessera-cache
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 300 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture attention > "$OUT/cuda_ops_attn.log" 2>&1
echo "cuda_ops attention: rc=$?"
grep -E "test result|panicked" -A2 "$OUT/cuda_ops_attn.log" | head -20
timeout 200 .dev/bin/tessera bench attention --device cuda > "$OUT/bench_attention.jsonl" 2>&1
echo "bench attention: rc=$?"
python3 - "$OUT/bench_attention.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip())
        continue
    print(f"{r['shape']:<20} {str(r.get('kernel')):<6} chunks={r['kv_splits']} chosen={r['chosen']!s:<5} "
          f"{r['median_ms'] * 1e3:8.1f} us {r['tflops']:6.1f} TFLOP/s")
PY
