#!/usr/bin/env bash
# bf16 alternating: Tessera (AMX), PyTorch bf16 autocast, per workload, two rounds; then Tessera with TESSERA_AMX=0 on the document.
set -uo pipefail
cd /work/main
M=/tmp/eg2 D=/tmp/eg2data OUT=benchmarks/2026-12-06/cpu-amx/ab
mkdir -p $OUT
B=target/release/tessera
for round in 1 2; do
for w in document batch image; do
  case $w in
    document) it=3; t=(embed --model $M --inputs $D/bench_inputs.json --workloads w2) ;;
    batch) it=3; t=(embed --model $M --inputs $D/bench_inputs.json --workloads batch --batch 64x64) ;;
    image) it=3; t=(image --model $M --image $D/image/img_a_641x479.png --images 0) ;;
  esac
  $B --threads 2 bench "${t[@]}" --device cpu --precision bf16 --iters $it | tee -a $OUT/tessera_bf16.jsonl
  /work/venv/bin/python tools/cpu/eg2_cpu_ref.py $M --threads 2 --bf16 --workloads $w --batch 64x64 --iters $it 2>/dev/null | grep -v '"load"' | tee -a $OUT/torch_bf16.jsonl
done
done
TESSERA_AMX=0 $B --threads 2 bench embed --model $M --inputs $D/bench_inputs.json --workloads w2 --device cpu --precision bf16 --iters 3 | tee -a $OUT/tessera_bf16_noamx.jsonl
