#!/usr/bin/env bash
# Issue 18's CPU table on this machine: Tessera and PyTorch alternating, one workload at a time,
# each engine loading the model once per workload, every figure with the 1-minute load average
# when it ended. Nothing else should run meanwhile.
#
#   tools/cpu/eg2_cpu_bench.sh MODEL_DIR DATA_DIR OUT_DIR
#
# MODEL_DIR/DATA_DIR from tools/device/make_eg2_full.py. Environment: BIN (tessera binary,
# default target/release/tessera), PY (python with torch 2.15 and transformers 5.25, default
# .venv-ref/bin/python), THREADS (default 2), ITERS_QUERY/ITERS_DOC/ITERS_BATCH/ITERS_IMAGE,
# BATCH (default 64x64), TORCH_BF16=1 to add PyTorch's bf16 autocast runs, TESSERA_BF16=1 to add
# Tessera's --precision bf16 runs (each with its own peak RSS), DENORMAL_MAX (default 1.5: the
# run stops first if Tessera's work on denormal operands is slower than that against normal
# ones, issue 32's cliff).
set -euo pipefail
M=$1 D=$2 OUT=$3
BIN=${BIN:-target/release/tessera} PY=${PY:-.venv-ref/bin/python} THREADS=${THREADS:-2}
BATCH=${BATCH:-64x64}
mkdir -p "$OUT"
here=$(dirname "$0")
torch_ref() { "$PY" "$here/eg2_cpu_ref.py" "$M" --threads "$THREADS" "$@"; }
echo "== denormals"
"$BIN" --threads "$THREADS" bench denormals --max-slowdown "${DENORMAL_MAX:-1.5}" | tee -a "$OUT/tessera.jsonl"
for w in query document batch image; do
  case $w in
    query) it=${ITERS_QUERY:-30}; t_args=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads w1) ;;
    document) it=${ITERS_DOC:-5}; t_args=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads w2) ;;
    batch) it=${ITERS_BATCH:-3}; t_args=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads batch --batch "$BATCH") ;;
    image) it=${ITERS_IMAGE:-3}; t_args=(image --model "$M" --image "$D/image/img_a_641x479.png" --images 0) ;;
  esac
  echo "== $w"
  /usr/bin/time -f '{"name": "peak_rss", "engine": "tessera", "workload": "'$w'", "kib": %M}' \
    -o "$OUT/rss_tessera_$w.json" "$BIN" --threads "$THREADS" bench "${t_args[@]}" --device cpu --iters "$it" \
    | tee -a "$OUT/tessera.jsonl"
  /usr/bin/time -f '{"name": "peak_rss", "engine": "torch", "workload": "'$w'", "kib": %M}' \
    -o "$OUT/rss_torch_$w.json" "$PY" "$here/eg2_cpu_ref.py" "$M" --threads "$THREADS" --workloads "$w" \
    --batch "$BATCH" --iters "$it" | tee -a "$OUT/torch.jsonl"
  if [ -n "${TESSERA_BF16:-}" ]; then
    /usr/bin/time -f '{"name": "peak_rss", "engine": "tessera-bf16", "workload": "'$w'", "kib": %M}' \
      -o "$OUT/rss_tessera-bf16_$w.json" "$BIN" --threads "$THREADS" bench "${t_args[@]}" --device cpu \
      --precision bf16 --iters "$it" | tee -a "$OUT/tessera_bf16.jsonl"
  fi
  if [ -n "${TORCH_BF16:-}" ]; then
    torch_ref --bf16 --workloads "$w" --batch "$BATCH" --iters "$it" | tee -a "$OUT/torch_bf16.jsonl"
  fi
done
# Peak resident memory of each process (model load included), from /usr/bin/time.
for f in "$OUT"/rss_*.json; do
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["mib"]=round(d.pop("kib")/1024,1); print(json.dumps(d))' "$f"
done | tee "$OUT/rss.jsonl"
