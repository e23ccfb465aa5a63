#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): the attention kernels alone — their
# parity against the CPU (cuda_ops, every kernel, whole and split), `tessera bench attention` on
# the EmbeddingGemma 2, vision and DiT shapes, and PyTorch's SDPA on the same shapes in the same
# call, as a short table. A few minutes of device time instead of a family's full run, for
# iterating on a kernel. Build first with TESTS=cuda_ops tools/device/stage.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TESSERA_CACHE_DIR=/tmp/tessera-cache
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
TESSERA_OP_CASE=attention timeout 300 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture ops_match_cpu > "$OUT/cuda_ops_attn.log" 2>&1
echo "cuda_ops attention: rc=$?"
grep -E "test result|panicked|FAIL|^total" -A2 "$OUT/cuda_ops_attn.log" | head -30
timeout 200 .dev/bin/tessera bench attention --device cuda > "$OUT/bench_attention.jsonl" 2>&1
echo "bench attention: rc=$?"
python3 tools/device/attn_table.py "$OUT/bench_attention.jsonl"
echo "== PyTorch SDPA, same shapes, same call"
timeout 120 python3 tools/device/sdpa_ref.py > "$OUT/sdpa_ref.jsonl" 2>&1
python3 tools/device/attn_table.py "$OUT/sdpa_ref.jsonl"
