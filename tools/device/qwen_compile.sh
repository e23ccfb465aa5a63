#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack and .dev/tools): Qwen-Image-2.1 at
# 1024² beside diffusers in one call (issue 27) — the full-size folder, `tessera bench generate`
# (bf16, 40 steps, two processes), then ../shared/tools/refbench_qi21_lfm2vl.sh's regional
# torch.compile of the DiT (`qi21c`) and, time permitting, the eager pipeline (`qi21`).
# Archives in $OUT (r0.tgz, r1.tgz). Build first: PACK=1 TESTS=cuda_ops tools/device/stage.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O=/tmp/qwen_compile; mkdir -p $O
tar -C .dev -xJf .dev/pack/bin.tar.xz
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
[ -f /tmp/qfull/model_index.json ] || python3 tools/device/make_qwen_image_full.py /tmp/qfull \
  crates/models/assets/qwen-image-mini > $O/make_q.log 2>&1
echo "== Qwen-Image-2.1 1024², 40 steps, bf16 (two processes, median of 2 each)"
for s in 1 2; do
  timeout 200 .dev/bin/tessera bench generate --model /tmp/qfull --device cuda --precision bf16 \
    --size 1024x1024 --steps 40 --iters 2 > $O/qi_$s.log 2>&1
  echo "qi_$s $(grep -E 'end to end' $O/qi_$s.log | grep -v '^{' | sed 's/.*: end to end/end to end/' | head -1 | cut -c1-110)"
done
tar czf "$OUT/r0.tgz" -C $O .
echo "== diffusers 0.42.1: regional compile of the DiT, then the eager pipeline, same call"
OUT=$O/ref PARTS="qi21c qi21" DEADLINE=${REF_DEADLINE:-420} bash .dev/tools/refbench_qi21_lfm2vl.sh > $O/refbench.log 2>&1
sed -n '/=== SUMMARY/,$p' $O/refbench.log | cut -c1-260
tar czf "$OUT/r1.tgz" -C $O .
