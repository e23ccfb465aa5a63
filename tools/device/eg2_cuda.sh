#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): EmbeddingGemma 2 on CUDA, parity first,
# then benchmarks against the PyTorch reference in the same call, then a short table.
#   PARTS=parity,sens,bench,ref (default all)   W3_DOCS=8192
# Writes logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-parity,sens,bench,ref}
W3_DOCS=${W3_DOCS:-8192}
export TESSERA_CACHE_DIR=/tmp/tessera-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl \
  && export PYTHONPATH=/tmp/site || { echo "wheel install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

M=/tmp/eg2 D=/tmp/eg2data
if [ ! -f $M/model.safetensors ]; then
  python3 .dev/tools/make_eg2_full.py $M $D --no-audio > "$OUT/make_model.log" 2>&1 || { tail -20 "$OUT/make_model.log"; exit 1; }
fi
export TESSERA_EG2_FULL=$M TESSERA_EG2_INPUTS=$D/bench_inputs.json TESSERA_ROOT=$PWD
status=0
if [[ $PARTS == *parity* ]]; then
  echo "== op parity (cuda vs cpu)"
  .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture > "$OUT/cuda_ops.log" 2>&1; r=$?; status=$((status|r))
  grep -E "^test |test result|panicked|rel max err" "$OUT/cuda_ops.log" | grep -E "test |result|panicked" | tail -12
  echo "== model parity (fixtures, full-size vs cpu, long-input error, OOM split)"
  .dev/bin/egemma2_cuda --ignored --test-threads=1 --nocapture > "$OUT/egemma2_cuda.log" 2>&1; r=$?; status=$((status|r))
  grep -E "^test |test result|panicked|worst|documents of" "$OUT/egemma2_cuda.log" | tail -16
fi
if [[ $PARTS == *sens* ]]; then
  echo "== rounding sensitivity of the full-size random model (vs torch float64)"
  python3 tools/device/eg2_sensitivity.py $M $D/bench_inputs.json .dev/bin/tessera "$OUT/sensitivity.json" 2> "$OUT/sensitivity.err" \
    || tail -5 "$OUT/sensitivity.err"
fi
if [[ $PARTS == *bench* ]]; then
  echo "== tessera bench"
  .dev/bin/tessera bench gemm --device cuda > "$OUT/tessera_bench.jsonl" 2>&1
  .dev/bin/tessera bench embed --device cuda --model $M --inputs $D/bench_inputs.json --w3-docs "$W3_DOCS" \
     >> "$OUT/tessera_bench.jsonl" 2> "$OUT/tessera_bench.err"
  TESSERA_PROFILE=1 .dev/bin/tessera bench embed --device cuda --model $M --inputs $D/bench_inputs.json --workloads w1 \
     > /dev/null 2> "$OUT/profile_w1.txt"
  TESSERA_PROFILE=1 .dev/bin/tessera bench embed --device cuda --model $M --inputs $D/bench_inputs.json --workloads w2 \
     > /dev/null 2> "$OUT/profile_w2.txt"
  TESSERA_PROFILE=1 .dev/bin/tessera bench embed --device cuda --model $M --inputs $D/bench_inputs.json --workloads w3 \
     --w3-docs 256 --w3-pass-tokens 65536 > /dev/null 2> "$OUT/profile_w3.txt"
  cat "$OUT/tessera_bench.jsonl"; tail -3 "$OUT/tessera_bench.err"
  tail -1 "$OUT/profile_w1.txt"; tail -1 "$OUT/profile_w2.txt"; tail -1 "$OUT/profile_w3.txt"
fi
if [[ $PARTS == *ref* ]]; then
  echo "== reference (transformers 5.25, bf16, sdpa)"
  python3 .dev/tools/refbench.py --only egemma2 > "$OUT/refbench.jsonl" 2> "$OUT/refbench.err"
  grep '^{' "$OUT/refbench.jsonl"; tail -3 "$OUT/refbench.err"
fi
exit $status
