#!/usr/bin/env bash
# Issue 32's bf16 comparison on this machine: Tessera --precision bf16 and PyTorch's bf16
# autocast alternating workload by workload (document, batch, image), ROUNDS rounds, then Tessera
# with TESSERA_AMX=0 on the document (the same binary without AMX tiles). Nothing else should run.
#
#   tools/cpu/eg2_bf16_ab.sh MODEL_DIR DATA_DIR OUT_DIR
#
# MODEL_DIR/DATA_DIR from tools/device/make_eg2_full.py. Environment: BIN (default
# target/release/tessera), PY (python with torch 2.15 and transformers 5.25, default
# .venv-ref/bin/python), THREADS (2), ITERS (3), ROUNDS (2), BATCH (64x64).
set -uo pipefail
M=$1 D=$2 OUT=$3
BIN=${BIN:-target/release/tessera} PY=${PY:-.venv-ref/bin/python} THREADS=${THREADS:-2}
ITERS=${ITERS:-3} ROUNDS=${ROUNDS:-2} BATCH=${BATCH:-64x64}
here=$(dirname "$0")
mkdir -p "$OUT"
for _ in $(seq "$ROUNDS"); do
  for w in document batch image; do
    case $w in
      document) t=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads w2) ;;
      batch) t=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads batch --batch "$BATCH") ;;
      image) t=(image --model "$M" --image "$D/image/img_a_641x479.png" --images 0) ;;
    esac
    "$BIN" --threads "$THREADS" bench "${t[@]}" --device cpu --precision bf16 --iters "$ITERS" \
      | tee -a "$OUT/tessera_bf16.jsonl"
    "$PY" "$here/eg2_cpu_ref.py" "$M" --threads "$THREADS" --bf16 --workloads "$w" --batch "$BATCH" \
      --iters "$ITERS" 2>/dev/null | grep -v '"load"' | tee -a "$OUT/torch_bf16.jsonl"
  done
done
TESSERA_AMX=0 "$BIN" --threads "$THREADS" bench embed --model "$M" --inputs "$D/bench_inputs.json" \
  --workloads w2 --device cpu --precision bf16 --iters "$ITERS" | tee -a "$OUT/tessera_bf16_noamx.jsonl"
