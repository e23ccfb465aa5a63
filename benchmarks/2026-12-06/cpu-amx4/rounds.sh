#!/usr/bin/env bash
# Two more rounds of bf16 (and the f32 image), Tessera and PyTorch alternating.
set -euo pipefail
cd /work/main
M=/tmp/eg2 D=/tmp/eg2data OUT=benchmarks/2026-12-06/cpu-amx4/rounds BIN=.dev/bin/tessera-cfc668e PY=/work/venv/bin/python
mkdir -p $OUT
for round in 1 2; do
  for w in document batch image; do
    case $w in
      document) t_args=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads w2) ;;
      batch) t_args=(embed --model "$M" --inputs "$D/bench_inputs.json" --workloads batch --batch 64x64) ;;
      image) t_args=(image --model "$M" --image "$D/image/img_a_641x479.png" --images 0) ;;
    esac
    "$BIN" --threads 2 bench "${t_args[@]}" --device cpu --precision bf16 --iters 3 | sed "s/^{/{\"round\":$round,/" >> $OUT/tessera_bf16.jsonl
    "$PY" tools/cpu/eg2_cpu_ref.py "$M" --threads 2 --bf16 --workloads $w --batch 64x64 --iters 3 2>/dev/null | grep median | sed "s/^{/{\"round\":$round,/" >> $OUT/torch_bf16.jsonl
  done
  "$BIN" --threads 2 bench image --model "$M" --image "$D/image/img_a_641x479.png" --images 0 --device cpu --iters 3 | sed "s/^{/{\"round\":$round,/" >> $OUT/tessera.jsonl
  "$PY" tools/cpu/eg2_cpu_ref.py "$M" --threads 2 --workloads image --batch 64x64 --iters 3 2>/dev/null | grep median | sed "s/^{/{\"round\":$round,/" >> $OUT/torch.jsonl
done
echo done
